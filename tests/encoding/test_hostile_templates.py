"""Chat templates are code from disk (issue 35, item 1).

A template that loops ``10**15`` times, or renders or builds a gigabyte, for some rows makes
that row a counted ``bad_sample`` naming its key within seconds (the render is bounded in time
and size, see ``energon_pack.encoding.bounded``); one that does so on the probe conversation
is refused when the encoder is made. Each attack runs in a child process (address space
capped, wall-clock timeout), so a regression fails the test instead of hanging or killing it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

SEED = 20261202
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the child imports real_qwen from here
CHILD_TIMEOUT = int(os.environ.get("ENERGON_PACK_TEST_CHILD_TIMEOUT", "240"))

_TURN = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
_MARKED_TURN = (
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}"
    "<|im_end|>{% endgeneration %}\n{% else %}" + _TURN + "{% endif %}"
)
_ATTACKS = {
    "nested_ranges_1e15": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}"
    ),
    "call_free_loops_1e15": (
        "{% set xs = range(99999)|list %}{% for a in xs %}{% for b in xs %}{% for c in xs %}"
        "{% endfor %}{% endfor %}{% endfor %}"
    ),
    "stream_1e15_chars": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ 'x' * 100000 }}"
        "{% endfor %}{% endfor %}"
    ),
    "concat_doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}"
    ),
    "plus_doubling_list": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
        "{% endfor %}{{ ns.l|length }}"
    ),
    "repeat_10gb": "{{ ('x' * 10**10)|length }}",
    "power": "{% set n = 99999999 %}{{ (n ** n)|string|length }}",
    "center_literal": "{{ 'x'|center(10000000000)|length }}",
    "repeat_literal": "{{ ('x' * 10000000000)|length }}",
    "repeat_literal_3gb": "{{ 'x' * 3000000000 }}",  # fits the child's address space
    "center_10gb": "{{ 'x'|center(10**10)|length }}",
    "join_doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
        "{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}{{ ns.s|length }}"
    ),
}


_TIMED = {"nested_ranges_1e15", "call_free_loops_1e15"}
"""The attacks the time bound stops; the size bound stops the others."""


def _template(payload: str, *, marked: bool = False, always: bool = False) -> str:
    trigger = "true" if always else "m.content == 'ATTACK'"
    turn = _MARKED_TURN if marked else _TURN
    return (
        "{% for m in messages %}{% if "
        + trigger
        + " %}"
        + payload
        + "{% endif %}"
        + turn
        + "{% endfor %}"
    )


_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    sys.path.insert(0, sys.argv[1])
    import energon_pack.encoding.bounded as bounded
    from real_qwen import real_qwen_tokenizer
    from energon_pack.encoding.template import TemplateEncoder
    from energon_pack.media import MediaError
    cases = json.loads(sys.stdin.read())
    tokenizer = real_qwen_tokenizer()
    for case in cases:
        if case["seconds"] is not None:
            bounded.RENDER_SECONDS = case["seconds"]
        start = time.monotonic()
        result = {}
        try:
            encoder = TemplateEncoder(tokenizer, chat_template=case["template"])
            ok = encoder.encode_sample("ok-row", {"conversations": [
                {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
            result = {"outcome": "encoded", "ok_ids": len(ok.input_ids)}
            encoder.encode_sample(case["key"], {"conversations": [
                {"from": "human", "value": "ATTACK"}, {"from": "gpt", "value": "fine"}]})
        except MediaError as error:
            result.update(outcome="MediaError", kind=error.kind, message=str(error))
        except ValueError as error:
            result = {"outcome": "ValueError", "message": str(error)}
        except BaseException as error:
            result = {"outcome": type(error).__name__, "message": str(error)[:300]}
        result["seconds"] = time.monotonic() - start
        result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(json.dumps({"name": case["name"], **result}), flush=True)
    """
)


@cache
def _run(cases_json: str) -> dict[str, dict[str, Any]]:
    """Each case's outcome in one child process (a hang fails every case, by the timeout)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(SUPPORT)],
            input=cases_json,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the child did not return in {CHILD_TIMEOUT} s: {error.stdout!r:.2000}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        pytest.fail(f"child rc={done.returncode}: {done.stderr[-3000:]}")
    return {line["name"]: line for line in lines}


def _cases(**options: Any) -> str:
    seconds = options.pop("seconds", 1.0)
    return json.dumps(
        [
            {
                "name": name,
                "key": f"row-{name}-{SEED}",
                "template": _template(payload, **options),
                "seconds": seconds,
            }
            for name, payload in _ATTACKS.items()
        ]
    )


@pytest.mark.parametrize("marked", [False, True], ids=["chatml_rule", "generation_markers"])
@pytest.mark.parametrize("name", sorted(_ATTACKS))
def test_a_hostile_row_is_a_bad_sample_naming_its_key_in_seconds(name: str, marked: bool) -> None:
    result = _run(_cases(marked=marked))[name]
    assert result["outcome"] == "MediaError", result
    assert result["ok_ids"] > 0  # the same template encodes a normal row
    assert result["kind"] == "bad_sample"
    assert f"row-{name}-{SEED}" in result["message"]
    assert "render bound" in result["message"]
    assert "fix the template" in result["message"]
    assert result["seconds"] < 30, result
    assert result["rss_mb"] < 2000, result  # nothing big was allocated, even at compile time
    bound = "ran longer than 1 s" if name in _TIMED else "16,777,216"
    bound = "1,048,576 bits" if name == "power" else bound
    assert bound in result["message"]


@pytest.mark.parametrize("name", ["nested_ranges_1e15", "stream_1e15_chars", "repeat_10gb"])
def test_a_template_over_a_bound_on_the_probe_is_refused_at_construction(name: str) -> None:
    result = _run(_cases(always=True))[name]
    assert result["outcome"] == "ValueError", result
    assert "render bound on a two-turn probe" in result["message"]
    assert "5 s" in result["message"] or "1 s" in result["message"]
    assert "16,777,216 characters" in result["message"]


def test_the_default_time_bound_stops_an_endless_loop() -> None:
    start = time.monotonic()
    cases = json.loads(_cases(seconds=None))
    result = _run(json.dumps([c for c in cases if c["name"] == "call_free_loops_1e15"]))
    result = result["call_free_loops_1e15"]
    assert result["outcome"] == "MediaError", result
    assert "5 s" in result["message"]
    assert 4 < result["seconds"] < 30
    assert time.monotonic() - start < CHILD_TIMEOUT


def test_templates_that_raise_or_recurse_stay_bad_samples_and_loops_keep_their_output() -> None:
    from real_qwen import real_qwen_tokenizer

    from energon_pack.encoding.template import TemplateEncoder
    from energon_pack.media import MediaError

    tokenizer = real_qwen_tokenizer()
    template = _template(
        "{{ raise_exception('no') }}{% macro f(n) %}{{ f(n) }}{% endmacro %}"
        "{% for x in [3, 1, 2]|sort %}{{ loop.index }}/{{ loop.length }}{% endfor %}"
    ).replace("m.content == 'ATTACK'", "m.content in ('ATTACK', 'RECURSE')")
    recurse = template.replace(
        "{{ raise_exception('no') }}",
        "{% if m.content == 'RECURSE' %}{{ f(1) }}{% else %}{{ raise_exception('no') }}{% endif %}",
    )
    encoder = TemplateEncoder(tokenizer, chat_template=recurse)
    for key, text in (("raises", "ATTACK"), ("recurses", "RECURSE")):
        with pytest.raises(MediaError, match=key) as caught:
            encoder.encode_sample(
                key,
                {
                    "conversations": [
                        {"from": "human", "value": text},
                        {"from": "gpt", "value": "x"},
                    ]
                },
            )
        assert caught.value.kind == "bad_sample"
    looped = "{% for x in [3, 1, 2]|sort %}{{ loop.index }}/{{ loop.length }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    plain = _template(looped, always=True)
    reference = tokenizer.apply_chat_template(messages, chat_template=plain, tokenize=False)
    assert "1/32/33/3" in reference
    got = TemplateEncoder(tokenizer, chat_template=plain)._bounded.render(
        messages, tools=None, variables=dict(tokenizer.special_tokens_map)
    )
    assert got == (reference, [])


def test_the_default_system_prompt_probe_is_bounded_too() -> None:
    """The ChatML encoder's ``template_system`` renders the template once at construction: a
    render over the size bound is a ValueError naming the bound, not an unbounded render."""
    from types import SimpleNamespace

    from energon_pack.encoding.chatml import template_system_prompt

    flood = "{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}"
    with pytest.raises(ValueError, match=r"went over a render bound.*16,777,216 characters"):
        template_system_prompt(SimpleNamespace(chat_template=flood, special_tokens_map={}))
    qwen = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + _TURN.join(
        ["{% for m in messages %}", "{% endfor %}"]
    )
    tokenizer = SimpleNamespace(chat_template=qwen, special_tokens_map={})
    assert template_system_prompt(tokenizer) == "You are a helpful assistant."
