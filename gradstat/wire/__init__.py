"""How numbers go over the wire: number formats and collectives as they run.

:mod:`~gradstat.wire.formats` rounds a message to a wire format (bf16, fp16, fp8, OCP
MX; MX blocks and packing in :mod:`~gradstat.wire.mx`), :mod:`~gradstat.wire.collectives`
runs a collective (ring, tree, all-to-all) with that format and the accumulation on every
hop (one hop over all chunks: :mod:`~gradstat.wire.hops`), and
:mod:`~gradstat.wire.shards` lays a flat message out as FSDP's reduce-scatter shards.
Torch math, no I/O; used by
the compressors (a format as a compressor: :mod:`gradstat.compressors.cast`), the cost
model and the training hooks. See docs/lowprecision.md.
"""
