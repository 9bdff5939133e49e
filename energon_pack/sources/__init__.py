"""Where samples come from, and the engines that read them in parallel.

A source (:func:`~energon_pack.sources.rows.open_source`) is a JSONL or JSON-array file, a
Parquet file, a folder ``datasets`` saved, or a Megatron-Energon dataset; it is cut into
partitions that any worker on any machine reads on its own, and each partition is worked in
this process or on Ray Data (:mod:`~energon_pack.sources.engine`). Plans and offline packs read
their input through here.

One module per concern: ``files`` (reading files, named errors, digests, JSON records),
``rows`` (files and folders of rows), ``energon`` (an Energon dataset read by Energon),
``engine`` (this process or Ray Data).
"""
