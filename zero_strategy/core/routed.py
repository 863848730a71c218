"""Routed blocks: modules that run a data-dependent subset of their children (mixture of
experts), recognised from the model's structure alone.

At stage 3 every rank must gather the same units in the same order. A block whose experts are
separate modules calls only the experts its tokens were routed to, so experts that were their
own units would be gathered on some ranks and not on others. A recognised block is instead
gathered as one unit with everything below it (as if its class were listed in
``ZeroConfig(unit_leaf_classes=...)``): entering the block is the same on every rank, and
nothing under it issues a collective of its own, whatever the routing.

The design choice: one unit per block rather than gathering experts in a fixed order. A fixed
order would need every expert gathered before the block runs anyway (which experts run is only
known inside the block's forward, after the router), so it costs the same memory while adding
a hook per expert and a second order to keep in step in backward, where unused experts never
fire a pre-backward hook at all. Fused experts (3-D weights in one module, transformers >= 5)
are already one module called on every rank and need nothing from here.

What counts as a routed block, structurally (no framework class is named):

- a direct child that is a ``ModuleList`` / ``ModuleDict`` of at least two experts, all of one
  class with the same parameter names and shapes;
- a router beside it: a 2-D parameter of the block itself or of one of its other direct
  children (not an embedding table), one of whose dimensions is the number of experts and the
  other a width the experts' parameters have (``Linear(hidden, n_experts)`` as in Mixtral,
  Qwen2-MoE, DeepSeek's gate parameter, or a raw ``[hidden, n]`` parameter).

A dense stack (GPT-2's ``h``, Llama's ``layers``) is a list of alike modules too, but nothing
beside it has one dimension equal to the number of layers and the other a layer's width save
an embedding table (positions), which is excluded; the unit split of dense models is therefore
unchanged (pinned by tests/quick/test_routed_blocks.py). A routed block without such a router
(experts chosen by token id, by a hash, by a rule in code) is not recognised: stage 3 then
raises ``GatherOrderError`` naming ``unit_leaf_classes`` when ranks diverge.
"""

from __future__ import annotations

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _experts(container: nn.Module) -> list[nn.Module] | None:
    """The container's entries when they look like interchangeable experts, else None."""
    entries = list(container.children())
    if len(entries) < 2 or len({type(e) for e in entries}) != 1:
        return None
    shapes = [[(n, tuple(p.shape)) for n, p in e.named_parameters()] for e in entries]
    if not shapes[0] or any(s != shapes[0] for s in shapes[1:]):
        return None
    return entries


def _router_candidates(block: nn.Module, experts: nn.Module) -> list[tuple[int, ...]]:
    """Shapes of the 2-D parameters of ``block`` itself and of its direct children other than
    ``experts`` and embedding tables."""
    shapes = [tuple(p.shape) for p in block.parameters(recurse=False)]
    for child in block.children():
        if child is experts or isinstance(child, (nn.Embedding, nn.EmbeddingBag)):
            continue
        shapes += [tuple(p.shape) for p in child.parameters(recurse=False)]
    return [s for s in shapes if len(s) == 2]


def is_routed_block(block: nn.Module) -> bool:
    for child in block.children():
        if not isinstance(child, _CONTAINERS):
            continue
        entries = _experts(child)
        if entries is None:
            continue
        n = len(entries)
        widths = {d for p in entries[0].parameters() for d in p.shape}
        for rows, cols in _router_candidates(block, child):
            if (rows == n and cols in widths) or (cols == n and rows in widths):
                return True
    return False


def routed_blocks(model: nn.Module) -> frozenset[int]:
    """The ids of the model's recognised routed blocks (each module once, however often it is
    registered)."""
    return frozenset(id(m) for m in model.modules() if is_routed_block(m))
