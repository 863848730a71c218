"""Block-wise int8 encoding of what the collectives send (ZeRO++, arXiv:2306.10209: quantized
weight all-gather and quantized gradient reduction).

A flat tensor is cut into blocks of ``BLOCK`` elements; each block is sent as int8 values and
one fp32 scale (the block's largest magnitude / 127), so a value is off by at most half a
step, ``max|block| / 254``, and an outlier only coarsens its own block. The scales add 4
bytes per block: 1/64 of the int8 payload. Only communication is encoded: the fp32 masters
and the optimizer never see a quantized value, and a reduction adds the decoded values of
every rank in fp32.

Every function writes into buffers the caller lends (the engine's pool): a full-size
temporary allocated per call would cost fresh pages each time on a CPU, more than the
arithmetic itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BLOCK = 256

CODECS = ("off", "int8")
"""What ``ZeroConfig.quantize_weights`` / ``quantize_gradients`` accept."""


def blocks(numel: int) -> int:
    """How many blocks (and scales) ``numel`` elements take; the payload is that many times
    ``BLOCK`` int8 values (the last block padded with zeros)."""
    return -(-numel // BLOCK)


CHUNK = 4096 * BLOCK
"""Elements a host encodes or decodes per pass (4 MiB of fp32): every function makes several
passes over its data, and done a chunk at a time they run in cache instead of memory
(measured 1.8x faster to encode a 6M-element shard on a 2 MiB L2 / 32 MiB L3 CPU than
whole). An accelerator takes the whole tensor in each pass: a chunk would only multiply its
kernel launches."""


def chunk_numel(device: torch.device) -> int | None:
    """How many elements one pass takes on ``device``; None: all of them."""
    return CHUNK if device.type == "cpu" else None


def scratch_numel(numel: int, device: torch.device) -> int:
    """The fp32 scratch ``encode`` and ``decode_add`` need for ``numel`` elements."""
    whole = blocks(numel) * BLOCK
    chunk = chunk_numel(device)
    return whole if chunk is None else min(whole, chunk)


def _chunks(numel: int, device: torch.device) -> Iterator[tuple[int, int]]:
    step = chunk_numel(device) or max(numel, 1)
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


def encode(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
           scratch: torch.Tensor) -> None:
    """int8 ``payload`` (``blocks(n) * BLOCK`` elements) and fp32 ``scales`` (``blocks(n)``)
    of the 1-D tensor ``x`` of n elements, which is left unchanged; ``scratch``: fp32, at
    least ``scratch_numel(n, x.device)`` elements."""
    n = x.numel()
    full = n - n % BLOCK
    for start, end in _chunks(full, x.device):
        rows = (end - start) // BLOCK
        _encode_rows(x[start:end].view(rows, BLOCK), payload[start:end].view(rows, BLOCK),
                     scales[start // BLOCK : end // BLOCK],
                     scratch[: end - start].view(rows, BLOCK))
    if full < n:  # the last, partial block, padded with zeros
        tail = scratch[:BLOCK]
        tail.zero_()
        tail[: n - full] = x[full:]
        _encode_rows(tail.view(1, BLOCK), payload[full : full + BLOCK].view(1, BLOCK),
                     scales[full // BLOCK :], tail.view(1, BLOCK))


def _encode_rows(rows: torch.Tensor, out: torch.Tensor, scales: torch.Tensor,
                 scratch: torch.Tensor) -> None:
    # The largest magnitude per row without a temporary of the rows' size. 16-bit rows (bf16
    # or fp16 weights and gradients) reduce in their own dtype (exact: a max rounds nothing)
    # into one small tensor per row set, converted to the fp32 scales once.
    if rows.dtype == scales.dtype:
        torch.amax(rows, dim=1, out=scales)
    else:
        scales.copy_(torch.amax(rows, dim=1))
    torch.maximum(scales, torch.amin(rows, dim=1).to(scales.dtype).neg_(), out=scales)
    # An all-zero row has scale 0 and multiplier 0 (its values are 0 either way). Scaled so the
    # largest magnitude maps to 127, no value rounds outside [-127, 127].
    multiplier = torch.where(scales > 0, 127.0 / scales, torch.zeros_like(scales))
    torch.mul(rows, multiplier.unsqueeze(1), out=scratch).round_()
    out.copy_(scratch)
    scales.div_(127.0)


def decode(payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (n elements, any float dtype) <- the values ``encode`` sent. The int8 values
    are converted in place in ``out`` first: multiplying int8 by fp32 directly would convert
    them into a temporary of ``out``'s size."""
    n = out.numel()
    full = n - n % BLOCK
    for start, end in _chunks(full, out.device):
        rows = out[start:end].view(-1, BLOCK)
        rows.copy_(payload[start:end].view(-1, BLOCK))
        rows.mul_(scales[start // BLOCK : end // BLOCK].unsqueeze(1))
    if full < n:
        out[full:] = (payload[full : full + BLOCK].float()
                      * scales[full // BLOCK])[: n - full].to(out.dtype)


def decode_add(payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               scratch: torch.Tensor) -> None:
    """``out`` (fp32, n elements) += the values ``encode`` sent; ``scratch``: fp32, at least
    ``scratch_numel(n, out.device)`` elements."""
    n = out.numel()
    full = n - n % BLOCK
    for start, end in _chunks(full, out.device):
        values = scratch[: end - start].view(-1, BLOCK)
        values.copy_(payload[start:end].view(-1, BLOCK))
        out[start:end].view(-1, BLOCK).addcmul_(
            values, scales[start // BLOCK : end // BLOCK].unsqueeze(1))
    if full < n:  # the same fused multiply-add as the full blocks
        values = scratch[: n - full]
        values.copy_(payload[full:n])
        out[full:].addcmul_(values, scales[full // BLOCK])
