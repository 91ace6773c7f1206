"""Logical axes, declared where each leaf is defined.

Every array a run places on the mesh names what each of its dims IS (`embed`, `channels`,
`hidden`, ...): its logical axes. The module that defines the leaf declares them on the
field that holds it, and ppgd_tpu/mesh.py maps logical axes to mesh axes with its ONE rule
table (`mesh.RULES`, which lists the names):

    class Components(eqx.Module):
        V: dict[str, jax.Array] = axes.field("embed", "channels")  # every V_s [d_in, C_s]

- A declaration covers every array under the field (one array, or a dict/tuple of them),
  except inside an equinox Module there, which declares its own fields.
- `stack=(...)` on a field of stacked modules or arrays (a scanned block's layers, vmapped
  chunks) prepends those axes to everything declared inside it.
- `ROWS` stands for the leading axes of the run, `[B]` or `[B, T]` (`batch` then `seq`),
  and `SHARED_ROWS` for `[1, T...]` (one value shared by every row); mesh.py expands them
  with the run's number of leading axes.
- A declaration may be a function of the module holding the field (static fields only, e.g.
  an adversary's scope).
- `optimizer_state(of=...)` marks a field holding an optax state of a sibling field's
  parameters: its parameter-shaped trees take the parameters' axes (optax.tree_map_params,
  so any optax optimizer works), its other leaves must be scalars (a step count).

`of(tree)` returns the tree's logical axes (an `Axes` per leaf, same structure) and raises
AxesError naming the path of any array nothing declares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import optax

_AXES, _STACK, _OPTIMIZER_OF = "logical_axes", "logical_stack", "optimizer_state_of"


class AxesError(ValueError):
    """A leaf whose logical axes are not declared (names its path)."""


@dataclasses.dataclass(frozen=True)
class Leading:
    """The run's leading axes `[B]` / `[B, T]`: `first`, then `seq` for each other one."""

    first: str


ROWS = Leading("batch")  # one entry per batch row (and position)
SHARED_ROWS = Leading("shared")  # size 1 on the batch axis: shared by every row (positions kept)


class Axes(tuple):
    """The logical axes of one array: a pytree LEAF (a plain tuple would be a node)."""

    def expand(self, leading_ndim: int) -> tuple[str, ...]:
        """The names with `ROWS` / `SHARED_ROWS` written out for `leading_ndim` leading axes."""
        out: list[str] = []
        for a in self:
            out.extend((a.first, *("seq",) * (leading_ndim - 1)) if isinstance(a, Leading)
                       else (a,))
        return tuple(out)


def field(*names, stack: tuple[str, ...] = (), **kwargs):
    """An equinox field whose arrays have logical axes `names` (or `names[0](module)`, a
    function of the module holding the field), under `stack` leading axes. Keyword
    arguments go to `eqx.field`."""
    meta = {_STACK: tuple(stack)}
    if names:
        meta[_AXES] = names[0] if len(names) == 1 and callable(names[0]) else Axes(names)
    elif not stack:
        meta[_AXES] = Axes()  # a scalar
    return eqx.field(metadata=meta, **kwargs)


def optimizer_state(of: str, **kwargs):
    """An equinox field holding an optax state of the sibling field `of`'s parameters."""
    return eqx.field(metadata={_OPTIMIZER_OF: of}, **kwargs)


def of(tree, optimizer: optax.GradientTransformation | None = None) -> Any:
    """The logical axes of every array leaf of `tree`, as a tree of `Axes` shaped like it;
    `optimizer` made the optax states `optimizer_state` fields hold. Raises AxesError naming
    the path of a leaf nothing declares."""
    return _of(tree, None, (), optimizer, ())


def _declared(node: eqx.Module, f: dataclasses.Field) -> Axes | None:
    decl = f.metadata.get(_AXES)
    return Axes(decl(node)) if callable(decl) else decl


def _of(node, declared: Axes | None, stack: tuple, optimizer, path: tuple):
    if jax.tree_util.all_leaves([node]):
        if declared is None:
            raise AxesError(f"leaf {jax.tree_util.keystr(path)} (shape "
                            f"{tuple(getattr(node, 'shape', ()))}): no logical axes declared; "
                            "declare them on the field that holds it (ppgd_tpu.axes.field)")
        return Axes((*stack, *declared))
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    fields = ({f.name: f for f in dataclasses.fields(node)} if isinstance(node, eqx.Module)
              else {})
    out = []
    for (key,), child in children:
        f = fields.get(getattr(key, "name", None))
        sub = (*path, key)
        if f is None:
            out.append(_of(child, declared, stack, optimizer, sub))
        elif _OPTIMIZER_OF in f.metadata:
            name = f.metadata[_OPTIMIZER_OF]
            params = _of(getattr(node, name), None, stack, optimizer,
                         (*path, jax.tree_util.GetAttrKey(name)))
            out.append(_optimizer_axes(child, params, optimizer, sub))
        else:  # a module's field: what it declares, not what holds the module
            out.append(_of(child, _declared(node, f), (*stack, *f.metadata.get(_STACK, ())),
                           optimizer, sub))
    return jax.tree_util.tree_unflatten(treedef, out)


def _optimizer_axes(state, params_axes, optimizer, path: tuple):
    """The axes of an optax state: its parameter-shaped trees take `params_axes`; any other
    leaf must be a scalar (a count)."""
    if optimizer is None:
        raise AxesError(f"{jax.tree_util.keystr(path)}: an optimizer state; pass the optimizer "
                        "that made it to axes.of")

    def other(x):
        if getattr(x, "ndim", 0):
            raise AxesError(f"{jax.tree_util.keystr(path)}: a {x.ndim}-d optimizer leaf that is "
                            "not shaped like the parameters has no logical axes")
        return Axes()

    return optax.tree_utils.tree_map_params(optimizer, lambda _, a: a, state, params_axes,
                                            transform_non_params=other)
