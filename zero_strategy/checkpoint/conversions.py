"""Tensors that a checkpoint stores as other tensors: a model's fused ``gate_up_proj`` of all
experts saved as one ``gate_proj`` and one ``up_proj`` per expert, a ``qkv`` saved as ``q``,
``k`` and ``v``, a weight saved transposed or with its rotary rows permuted.

A converted tensor is described here as index rearrangements over its sources (``Source``,
``Cat``, ``Narrow``, ``Transpose``, ``Reshape``; the helpers below build transformers' ops from
them), never computed whole: ``read_target`` fills any flat element range [start, end) of the
target by mapping its coordinates back to (source, flat source index), one ``block`` at a
time (the largest aligned size always consecutive in one source: a whole expert's matrix in a
fused ``gate_up_proj``, a row of an interleaved one, one element of a transposed one), a
bounded batch at a time, merging consecutive indices of one source into contiguous reads.

Memory (the stated bound): besides the output range itself, one call holds at most as many
elements as the largest source tensor it reads from, in that source's dtype (a source's span
that the range needs, kept while its runs are short, or a chunk of a long run being cast),
plus index scratch for ``CHUNK`` elements (a dozen int64 tensors of at most that length:
~12 MiB). A source whose runs average ``MIN_RUN`` elements or more, in the target's dtype, is
read straight into place.

Nothing here knows transformers: ``integrations/hf/conversions.py`` turns its ops into these.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

CHUNK = 1 << 17
"""Target elements whose coordinates are mapped at once (index scratch ~ 12 x 8 bytes each)."""
MIN_RUN = 1 << 16
"""A source whose runs in the range average this many elements is read run by run, into place;
one with shorter runs is read as one span and gathered from."""


class ConversionError(ValueError):
    """An operation that does not fit the shapes it is given (the caller names the tensors)."""


# ---------------------------------------------------------------------------- the description
@dataclass(eq=False)
class Node:
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def leaves(self) -> list[Source]:
        out: list[Source] = []
        stack: list[Node] = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, Source):
                out.append(node)
            else:
                stack.extend(reversed(node.children()))
        return out

    def children(self) -> list[Node]:
        return []


@dataclass(eq=False)
class Source(Node):
    """A stored tensor: ``key`` in the checkpoint, of ``dtype``."""

    key: str = ""
    dtype: torch.dtype = torch.float32


@dataclass(eq=False)
class Cat(Node):
    parts: list[Node] = field(default_factory=list)
    dim: int = 0

    def children(self) -> list[Node]:
        return self.parts


@dataclass(eq=False)
class Narrow(Node):
    child: Node | None = None
    dim: int = 0
    start: int = 0

    def children(self) -> list[Node]:
        return [self.child]


@dataclass(eq=False)
class Transpose(Node):
    child: Node | None = None
    dim0: int = 0
    dim1: int = 1

    def children(self) -> list[Node]:
        return [self.child]


@dataclass(eq=False)
class Reshape(Node):
    child: Node | None = None

    def children(self) -> list[Node]:
        return [self.child]


@dataclass
class ConversionPlan:
    """What an integration derived from a folder's keys: each converted target (named as the
    model names it, before any base-model prefix is added or stripped) and, for each folder key
    consumed, the targets made of it."""

    targets: dict[str, Node] = field(default_factory=dict)
    consumed: dict[str, list[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    """Targets the model lacks (reported, as transformers reports them, by their names)."""


# ---------------------------------------------------------------------------- building
def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ConversionError(f"dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim if ndim else 0


def source(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Source:
    return Source(tuple(shape), key, dtype)


def reshape(node: Node, shape: tuple[int, ...]) -> Node:
    shape = tuple(shape)
    if math.prod(shape) != node.numel:
        raise ConversionError(f"cannot view {list(node.shape)} as {list(shape)}")
    if shape == node.shape:
        return node
    return Reshape(shape, node.children()[0] if isinstance(node, Reshape) else node)


def cat(parts: list[Node], dim: int) -> Node:
    if not parts:
        raise ConversionError("nothing to concatenate")
    ndim = len(parts[0].shape)
    dim = _dim(dim, ndim)
    for p in parts[1:]:
        if len(p.shape) != ndim or any(a != b for i, (a, b) in enumerate(
                zip(p.shape, parts[0].shape)) if i != dim):
            raise ConversionError(f"cannot concatenate {list(parts[0].shape)} and "
                                  f"{list(p.shape)} along dim {dim}")
    if len(parts) == 1:
        return parts[0]
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return Cat(tuple(shape), list(parts), dim)


def stack(parts: list[Node], dim: int) -> Node:
    if not parts:
        raise ConversionError("nothing to stack")
    first = parts[0].shape
    if any(p.shape != first for p in parts):
        raise ConversionError(f"cannot stack tensors of shapes "
                              f"{sorted({tuple(p.shape) for p in parts})}")
    dim = _dim(dim, len(first) + 1)
    return cat([reshape(p, first[:dim] + (1,) + first[dim:]) for p in parts], dim)


def narrow(node: Node, dim: int, start: int, length: int) -> Node:
    dim = _dim(dim, len(node.shape))
    if not 0 <= start <= start + length <= node.shape[dim]:
        raise ConversionError(f"[{start}, {start + length}) is outside dim {dim} of "
                              f"{list(node.shape)}")
    if length == node.shape[dim]:
        return node
    shape = list(node.shape)
    shape[dim] = length
    return Narrow(tuple(shape), node, dim, start)


def chunk(node: Node, chunks: int, dim: int) -> list[Node]:
    """``torch.chunk``: pieces of ceil(n / chunks), the last smaller, fewer if they run out."""
    dim = _dim(dim, len(node.shape))
    n = node.shape[dim]
    size = -(-n // chunks) if chunks > 0 else 0
    if size == 0:
        raise ConversionError(f"cannot chunk dim {dim} of {list(node.shape)} into {chunks}")
    return [narrow(node, dim, s, min(size, n - s)) for s in range(0, n, size)]


def split(node: Node, sizes: list[int], dim: int) -> list[Node]:
    dim = _dim(dim, len(node.shape))
    if sum(sizes) != node.shape[dim]:
        raise ConversionError(f"sizes {sizes} do not add up to dim {dim} of "
                              f"{list(node.shape)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [narrow(node, dim, s, n) for s, n in zip(starts, sizes)]


def transpose(node: Node, dim0: int, dim1: int) -> Node:
    ndim = len(node.shape)
    dim0, dim1 = sorted((_dim(dim0, ndim), _dim(dim1, ndim)))
    if dim0 == dim1 or node.shape[dim0] == 1 and node.shape[dim1] == 1:
        return node
    shape = list(node.shape)
    shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
    return Transpose(tuple(shape), node, dim0, dim1)


def interleave(node: Node, dim: int, inverse: bool) -> Node:
    """transformers' ``Interleave``: dim split in two halves (``[n/2, 2]``, or ``[2, n/2]``
    inverse), those swapped, flattened back."""
    dim = _dim(dim, len(node.shape))
    n = node.shape[dim]
    if n % 2:
        raise ConversionError(f"dim {dim} of {list(node.shape)} is odd: cannot interleave")
    pair = [2, n // 2] if inverse else [n // 2, 2]
    split_shape = node.shape[:dim] + tuple(pair) + node.shape[dim + 1:]
    return reshape(transpose(reshape(node, split_shape), dim, dim + 1), node.shape)


def permute_rows_for_rope(node: Node, n_heads: int, inverse: bool) -> Node:
    """transformers' ``PermuteForRope`` on a 1-d or 2-d tensor: each head's rows as
    ``[half, 2]`` (``[2, half]`` inverse), swapped; other ranks are left as they are."""
    if len(node.shape) not in (1, 2):
        return node
    rows = node.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ConversionError(f"{rows} rows do not split into {n_heads} heads of two halves")
    half = rows // n_heads // 2
    head = (2, half) if inverse else (half, 2)
    view = reshape(node, (n_heads, *head, *node.shape[1:]))
    return reshape(transpose(view, 1, 2), node.shape)


# ---------------------------------------------------------------------------- mapping
def _around(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])


def locate(node: Node, idx: torch.Tensor, ids: dict[int, int]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat indices ``idx`` (int64) of ``node``: each element's source (its number in
    ``ids``, by object identity) and flat index in that source."""
    while True:
        if isinstance(node, Source):
            return torch.full_like(idx, ids[id(node)]), idx
        if isinstance(node, Reshape):  # every node is logically contiguous: same flat index
            node = node.child
        elif isinstance(node, Narrow):
            _, n, inner = _around(node.shape, node.dim)
            outer, rest = idx // (n * inner), idx % (n * inner)
            idx = (outer * node.child.shape[node.dim] + node.start) * inner + rest
            node = node.child
        elif isinstance(node, Transpose):
            idx = _transposed(node, idx)
            node = node.child
        else:
            return _in_cat(node, idx, ids)


def _transposed(node: Transpose, idx: torch.Tensor) -> torch.Tensor:
    s, d0, d1 = node.shape, node.dim0, node.dim1
    n1, n0 = s[d0], s[d1]  # the child's dim0 has n0 elements; here they sit at dim1
    between, after = math.prod(s[d0 + 1:d1]), math.prod(s[d1 + 1:])
    c = idx % after
    t = idx // after
    i0 = t % n0
    t = t // n0
    b = t % between
    t = t // between
    i1 = t % n1
    a = t // n1
    return (((a * n0 + i0) * between + b) * n1 + i1) * after + c


def _in_cat(node: Cat, idx: torch.Tensor, ids: dict[int, int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    _, n, inner = _around(node.shape, node.dim)
    outer, rest = idx // (n * inner), idx % (n * inner)
    along, within = rest // inner, rest % inner
    sizes = [p.shape[node.dim] for p in node.parts]
    starts = torch.tensor([0, *accumulate(sizes)][:-1], dtype=torch.int64)
    which = torch.searchsorted(starts, along, right=True) - 1
    leaf, src = torch.empty_like(idx), torch.empty_like(idx)
    for k in torch.bincount(which, minlength=len(sizes)).nonzero().flatten().tolist():
        sel = (which == k).nonzero().flatten()
        sub = (outer[sel] * sizes[k] + along[sel] - int(starts[k])) * inner + within[sel]
        leaf[sel], src[sel] = locate(node.parts[k], sub, ids)
    return leaf, src


# ---------------------------------------------------------------------------- reading
Reader = Callable[..., torch.Tensor]
"""``read(key, start, end, out=None)``: flat elements [start, end) of a stored tensor."""


def block(node: Node) -> int:
    """The largest size b such that every aligned b elements of ``node`` (flat) are
    consecutive elements of one source: a whole expert's ``gate_proj`` in a fused
    ``gate_up_proj``, one row of an interleaved tensor, one element of a transposed one.
    Coordinates are then mapped one block at a time instead of one element."""
    if isinstance(node, Source):
        return max(node.numel, 1)
    if isinstance(node, Reshape):  # the same flat index
        return block(node.child)
    if isinstance(node, Narrow):
        _, n, inner = _around(node.shape, node.dim)
        return math.gcd(n * inner, node.child.shape[node.dim] * inner, node.start * inner,
                        block(node.child))
    if isinstance(node, Transpose):  # the dims after both are copied as they are
        return math.gcd(math.prod(node.shape[node.dim1 + 1:]), block(node.child))
    _, _, inner = _around(node.shape, node.dim)
    return math.gcd(*(p.shape[node.dim] * inner for p in node.parts),
                    *(block(p) for p in node.parts))


class _Pieces:
    """[start, end) of a node as pieces (aligned blocks, clipped to the range): each one's
    offset in the range, source, first source index and length, a bounded batch at a time."""

    def __init__(self, node: Node, start: int, end: int, ids: dict[int, int], step: int
                 ) -> None:
        self.node, self.start, self.end, self.ids = node, start, end, ids
        self.size = block(node)
        self.per = max(1, step // self.size)

    def __iter__(self):
        first, last = self.start // self.size, -(-self.end // self.size)
        for q in range(first, last, self.per):
            heads = torch.arange(q, min(q + self.per, last), dtype=torch.int64) * self.size
            lo = heads.clamp(min=self.start)
            length = (heads + self.size).clamp(max=self.end) - lo
            leaf, src = locate(self.node, heads, self.ids)
            yield lo - self.start, leaf, src + (lo - heads), length


def _runs(leaf: torch.Tensor, src: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Indices of the pieces that start a run (consecutive indices of one source), and the
    number of pieces."""
    brk = (leaf[1:] != leaf[:-1]) | (src[1:] != src[:-1] + length[:-1])
    return torch.cat([torch.zeros(1, dtype=torch.int64), brk.nonzero().flatten() + 1,
                      torch.tensor([leaf.numel()])])


def _survey(pieces: _Pieces, n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per source: elements the range takes from it, runs, lowest and highest index."""
    count, runs = [0] * n, [0] * n
    lo, hi = [-1] * n, [-1] * n
    for _, leaf, src, length in pieces:
        bounds = _runs(leaf, src, length)
        got = torch.zeros(n, dtype=torch.int64).index_add_(0, leaf, length).tolist()
        started = torch.bincount(leaf[bounds[:-1]], minlength=n).tolist()
        low = torch.full((n,), -1, dtype=torch.int64).scatter_reduce(
            0, leaf, src, "amin", include_self=False).tolist()
        high = torch.full((n,), -1, dtype=torch.int64).scatter_reduce(
            0, leaf, src + length - 1, "amax", include_self=False).tolist()
        for k in (k for k in range(n) if got[k]):
            count[k] += got[k]
            runs[k] += started[k]
            lo[k] = low[k] if lo[k] < 0 else min(lo[k], low[k])
            hi[k] = max(hi[k], high[k])
    return count, runs, lo, hi


def read_target(node: Node, start: int, end: int, read: Reader, out: torch.Tensor, *,
                step: int = CHUNK, min_run: int = MIN_RUN) -> torch.Tensor:
    """Fill ``out`` (flat, ``end - start`` elements, any dtype and device) with elements
    [start, end) of ``node``, cast as ``Tensor.to`` casts; see the module doc for the memory
    this takes. Runs of one source that average ``min_run`` elements are read into place; the
    other sources' spans are read once each (while the range still needs them) and gathered
    from."""
    if not 0 <= start <= end <= node.numel or out.numel() != end - start:
        raise ValueError(f"range [{start}, {end}) of {list(node.shape)} into "
                         f"{out.numel()} elements")
    if start == end:
        return out
    leaves = list({id(leaf): leaf for leaf in node.leaves()}.values())  # one may recur
    ids = {id(leaf): k for k, leaf in enumerate(leaves)}
    pieces = _Pieces(node, start, end, ids, step)
    count, runs, lo, hi = _survey(pieces, len(leaves))
    direct = [count[k] >= min_run * runs[k] for k in range(len(leaves))]
    cache = _Spans(read, max((leaf.numel for leaf, c in zip(leaves, count) if c), default=0))
    is_direct = torch.tensor(direct)
    for pos, leaf, src, length in pieces:
        bounds = _runs(leaf, src, length)
        heads = bounds[:-1]
        ends = torch.cumsum(length, 0)[bounds[1:] - 1] + pos[0]
        keep = is_direct[leaf[heads]] | (pieces.size >= step)  # runs copied one by one
        for p, e, k, s in zip(pos[heads][keep].tolist(), ends[keep].tolist(),
                              leaf[heads][keep].tolist(), src[heads][keep].tolist()):
            if direct[k]:
                _read_run(leaves[k], s, out[p:e], read, step)
            else:
                span = cache.get(k, leaves[k], lo[k], hi[k] + 1)
                out[p:e].copy_(span[s - lo[k]: s - lo[k] + e - p])
        if pieces.size >= step:
            continue
        short = torch.bincount(leaf[heads][~keep], minlength=len(leaves))
        for k in short.nonzero().flatten().tolist():  # short runs: gathered at once
            span = cache.get(k, leaves[k], lo[k], hi[k] + 1)
            sel = (leaf == k).nonzero().flatten()
            at, index = _elements(pos[sel], src[sel] - lo[k], length[sel])
            out.index_copy_(0, at.to(out.device), span[index].to(out.device, out.dtype))
    return out


def _elements(pos: torch.Tensor, src: torch.Tensor, length: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces as elements: each one's offset and source index (fewer than ``step`` of them:
    pieces are batched by ``step // block``)."""
    which = torch.repeat_interleave(torch.arange(length.numel()), length)
    within = torch.arange(which.numel()) - (torch.cumsum(length, 0) - length)[which]
    return pos[which] + within, src[which] + within


def _read_run(leaf: Source, first: int, place: torch.Tensor, read: Reader, step: int) -> None:
    n = place.numel()
    if place.device.type == "cpu" and place.dtype == leaf.dtype and place.is_contiguous():
        read(leaf.key, first, first + n, out=place)
        return
    for i in range(0, n, step):  # a cast copy of at most one chunk at a time
        m = min(step, n - i)
        place[i:i + m].copy_(read(leaf.key, first + i, first + i + m).reshape(-1))


class _Spans:
    """The spans of sources read in short runs, least recently used dropped first, never
    more than ``budget`` elements together (the largest source the range reads)."""

    def __init__(self, read: Reader, budget: int) -> None:
        self.read, self.budget = read, budget
        self.held: OrderedDict[int, torch.Tensor] = OrderedDict()

    def get(self, k: int, leaf: Source, lo: int, hi: int) -> torch.Tensor:
        if k in self.held:
            self.held.move_to_end(k)
            return self.held[k]
        while self.held and sum(t.numel() for t in self.held.values()) + hi - lo > self.budget:
            self.held.popitem(last=False)
        self.held[k] = self.read(leaf.key, lo, hi).reshape(-1)
        return self.held[k]


def materialize(node: Node, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole target from whole sources, by torch's own ops: the reference that
    ``read_target`` is tested against (and a readable statement of what each node means)."""
    if isinstance(node, Source):
        return tensors[node.key].reshape(node.shape)
    if isinstance(node, Reshape):
        return materialize(node.child, tensors).reshape(node.shape)
    if isinstance(node, Narrow):
        return materialize(node.child, tensors).narrow(node.dim, node.start,
                                                       node.shape[node.dim])
    if isinstance(node, Transpose):
        return materialize(node.child, tensors).transpose(node.dim0, node.dim1).contiguous()
    return torch.cat([materialize(p, tensors) for p in node.parts], node.dim)


__all__ = ["CHUNK", "MIN_RUN", "Cat", "ConversionError", "ConversionPlan", "Narrow", "Node",
           "Reshape", "Source", "Transpose", "cat", "chunk", "interleave", "locate",
           "materialize", "narrow", "permute_rows_for_rope", "read_target", "reshape",
           "source", "split", "stack", "transpose"]
