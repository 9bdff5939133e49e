"""Chat templates rendered within bounds: a template is code from disk.

:class:`BoundedTemplate` renders a chat template in the same sandboxed Jinja environment as
transformers' ``apply_chat_template`` (its extensions, filters and globals, copied from the
environment transformers compiles the template with) and gives the same text and generation
spans, but every render is bounded:

* in time (:data:`RENDER_SECONDS`): checked at every loop item, call, operator on sizes and
  output piece, so a template that loops ``10**15`` times stops in seconds;
* in size (:data:`RENDER_CHARS`): the rendered stream is counted piece by piece, and every
  string or list a call, filter, ``~``, ``*``, ``**``, ``+`` or ``%`` makes is checked (``*`` and
  ``**`` before they allocate), so a template that renders a gigabyte stops at the bound.

A render over a bound raises :class:`RenderLimitError` naming the bound and the fix.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = [
    "RENDER_CHARS",
    "RENDER_SECONDS",
    "BoundedTemplate",
    "RenderLimitError",
    "has_generation_markers",
    "template_sha256",
]

RENDER_SECONDS = 5.0
"""Longest render of one sample's chat template (a normal conversation takes milliseconds)."""
RENDER_CHARS = 16 * 1024 * 1024
"""Most characters one render may produce, and the largest string or list it may build."""

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks the assistant replies with ``{% generation %}``."""
    return _GENERATION.search(template) is not None


def template_sha256(template: str) -> str:
    """The SHA-256 of a chat template's UTF-8 text (what the settings fingerprint records)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


_LOOP = "energon_pack_bounded_loop"
_SIZED = "energon_pack_bounded_size"
_POWER_BITS = 1 << 20  # an int ``**`` result over ~1 Mbit is refused before it is computed


class RenderLimitError(RuntimeError):
    """A chat template render went over a bound (time or size); the message names it."""


class _Budget:
    """The bounds of one render: a deadline and a size limit."""

    __slots__ = ("deadline", "max_chars", "seconds")

    def __init__(self, seconds: float, max_chars: int) -> None:
        self.seconds = seconds
        self.max_chars = max_chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitError(
                f"the chat template ran longer than {self.seconds:g} s for one conversation "
                "(an endless or huge loop); fix the template"
            )

    def size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            self.over(len(value))
        return value

    def over(self, size: int) -> None:
        raise RenderLimitError(
            f"the chat template built a value of {size:,} characters/items for one "
            f"conversation, over the limit of {self.max_chars:,}; fix the template"
        )


_ACTIVE: ContextVar[_Budget | None] = ContextVar("energon_pack_render_budget", default=None)


@pass_context
def _bounded_loop(_context: Any, value: Any) -> Any:
    budget = _ACTIVE.get()
    return value if budget is None else _ticking(value, budget)


def _ticking(value: Iterable[Any], budget: _Budget) -> Iterator[Any]:
    for item in value:
        budget.tick()
        yield item


@pass_context
def _bounded_size(_context: Any, value: Any) -> Any:
    budget = _ACTIVE.get()
    return value if budget is None else budget.size(value)


def _width_checked(function: Callable[..., Any]) -> Callable[..., Any]:
    @pass_context  # never folded at compile time, outside the render's budget
    def checked(_context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        width = args[0] if args else kwargs.get("width")
        budget = _ACTIVE.get()
        if budget is not None and isinstance(width, int) and width > budget.max_chars:
            budget.over(width)
        return function(value, *args, **kwargs)

    return checked


def _wrap(node: nodes.Node, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _Bounder(NodeTransformer):
    """Wraps every loop's iterable in a ticking iterator and every filter result and ``~``
    concatenation in a size check."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _wrap(node.iter, _LOOP)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _wrap(node, _SIZED)

    def visit_Filter(self, node: nodes.Filter) -> nodes.Node:
        self.generic_visit(node)
        if node.node is None or node.name in (_LOOP, _SIZED):  # a {% filter %} block's
            return node
        return _wrap(node, _SIZED)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the render budget checked at calls and sized operators."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        bounded: nodes.Template = _Bounder().visit(tree)
        return bounded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _ACTIVE.get()
        if budget is not None:
            budget.tick()
        result = super().call(__context, __obj, *args, **kwargs)
        return result if budget is None else budget.size(result)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _ACTIVE.get()
        if budget is not None:
            budget.tick()
            _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return result if budget is None else budget.size(result)


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse ``*`` and ``**`` whose result would be over the bound, before computing it."""
    sized = (str, list, tuple)
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if (
                isinstance(seq, sized)
                and isinstance(count, int)
                and len(seq) * count > budget.max_chars
            ):
                budget.over(len(seq) * count)
    elif (
        operator == "**"
        and isinstance(left, int)
        and isinstance(right, int)
        and abs(left) > 1
        and right * max(abs(left).bit_length() - 1, 1) > _POWER_BITS
    ):
        raise RenderLimitError(
            f"the chat template computes {left} ** {right} (over {_POWER_BITS:,} bits); "
            "fix the template"
        )


class BoundedTemplate:
    """A chat template compiled in a bounded copy of transformers' chat-template environment.

    Args:
        template: the chat template text.
        seconds, max_chars: the bounds of one render (default :data:`RENDER_SECONDS`,
            :data:`RENDER_CHARS`, read at each render).
    """

    def __init__(
        self, template: str, *, seconds: float | None = None, max_chars: int | None = None
    ) -> None:
        from transformers.utils import chat_template_utils as hf

        # transformers' environment (the same for every template: compiled from an empty one,
        # so that its constant folding never evaluates the hostile template's expressions)
        base = hf._compile_jinja_template("").environment
        env = _BoundedEnvironment(
            trim_blocks=base.trim_blocks,
            lstrip_blocks=base.lstrip_blocks,
            keep_trailing_newline=base.keep_trailing_newline,
            extensions=[type(extension) for extension in base.extensions.values()],
        )
        env.filters.update(base.filters)
        env.globals.update(base.globals)
        env.policies.update(base.policies)
        for name in ("center", "indent"):  # their width is allocated at once
            env.filters[name] = _width_checked(env.filters[name])
        env.filters[_LOOP] = _bounded_loop
        env.filters[_SIZED] = _bounded_size
        self.environment = env
        self.source = template
        self.template = env.from_string(template)
        self.seconds = seconds
        self.max_chars = max_chars
        identity: Callable[[Any], Any] = lambda value: value  # noqa: E731
        self._plain: Callable[[Any], Any] = getattr(hf, "_plain_template_data", identity)
        self._normalize: Callable[[Any], Any] = getattr(hf, "_normalize_chat_messages", _drop_none)
        self._alias: Callable[[Any], Any] = getattr(hf, "_alias_reasoning_fields", identity)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its template text and bounds, compiled again where it is loaded (a
        compiled environment does not pickle): encoders travel to spawned loader workers and
        Ray tasks."""
        state = {"seconds": self.seconds, "max_chars": self.max_chars}
        return type(self), (self.source,), state

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any],
        track_generation: bool = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text ``apply_chat_template(messages, tools=tools, tokenize=False,
        **variables)`` renders (``variables`` include the tokenizer's special tokens map), and
        the ``{% generation %}`` spans when ``track_generation``.

        Raises :class:`RenderLimitError` over a bound; template errors as transformers does.
        """
        chat = self._alias(self._plain(self._normalize(list(messages))))
        context = {
            "messages": chat,
            "tools": self._plain(None if tools is None else [dict(t) for t in tools]),
            "documents": None,
            "add_generation_prompt": False,
            **self._plain(dict(variables)),
        }
        budget = _Budget(
            RENDER_SECONDS if self.seconds is None else self.seconds,
            RENDER_CHARS if self.max_chars is None else self.max_chars,
        )
        token = _ACTIVE.set(budget)
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            if track_generation:
                with self.environment.activate_tracker(pieces, spans):  # type: ignore[attr-defined]
                    self._collect(pieces, context, budget)
            else:
                self._collect(pieces, context, budget)
        finally:
            _ACTIVE.reset(token)
        return "".join(pieces), [(int(a), int(b)) for a, b in spans]

    def _collect(self, pieces: list[str], context: dict[str, Any], budget: _Budget) -> None:
        total = 0
        for piece in self.template.generate(**context):
            total += len(piece)
            if total > budget.max_chars:
                raise RenderLimitError(
                    f"the chat template rendered over {budget.max_chars:,} characters for one "
                    "conversation; fix the template (or shorten the sample)"
                )
            budget.tick()
            pieces.append(piece)


def _drop_none(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in message.items() if v is not None} for message in conversation]
