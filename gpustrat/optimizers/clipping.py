"""Gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``) with Keras 3's
formulas, applied to the gradients a step uses: summed over every replica in sync (see
:mod:`gpustrat.optimizers.base`).

Words:
- *clipnorm* ``c``: each variable's gradient ``g`` becomes ``g * c / max(norm(g), c)``
  (``norm`` the L2 norm of all its elements; written so, it is also computed when the
  norm is below ``c``, as Keras does).
- *global_clipnorm* ``c``: every gradient is multiplied by
  ``c * min(1 / n, 1 / c)``, ``n`` the L2 norm of all the gradients together; an
  infinite or NaN ``n`` makes every gradient NaN.
- *clipvalue* ``c``: every element is clipped to ``[-c, c]``.

Norms stay on the gradients' device (no host read). Clipped gradients are new arrays:
the summed gradients may be shared by host replicas and are not written.
"""

from __future__ import annotations

import math

import numpy as np

from gpustrat.devices import array_module, on_device_of

#: The clipping arguments, in the order Keras lists them.
NAMES = ("clipnorm", "clipvalue", "global_clipnorm")


def check(clipnorm, clipvalue, global_clipnorm) -> None:
    """Raise ValueError unless each is None or a positive finite number and at most one
    is set (Keras 3's rule)."""
    given = {n: v for n, v in zip(NAMES, (clipnorm, clipvalue, global_clipnorm))
             if v is not None}
    for name, value in given.items():
        check_one(name, value)
    if len(given) > 1:
        raise ValueError(
            "at most one of clipnorm, clipvalue and global_clipnorm can be set, got "
            + ", ".join(f"{n}={v!r}" for n, v in given.items())
            + ": choose one (clipnorm clips each variable's gradient, global_clipnorm "
            "all of them together, clipvalue each element)")


def check_one(name: str, value) -> float | None:
    """``value`` as a float (None stays None); ValueError unless positive and finite."""
    if value is None:
        return None
    ok = not isinstance(value, (str, bytes, bool))
    if ok:
        try:
            number = float(value)
        except (TypeError, ValueError):
            ok = False
        else:
            ok = 0 < number < math.inf
    if not ok:
        raise ValueError(f"{name} must be a positive finite number or None (no "
                         f"clipping), got {value!r}")
    return number


def clip_list(optimizer, grads: list) -> list:
    """One replica's gradients (one array per variable) clipped by ``optimizer``'s
    setting; new arrays."""
    if optimizer.clipvalue is not None:
        c = optimizer.clipvalue
        return [_on(g, lambda g=g: array_module(g).clip(g, -c, c)) for g in grads]
    if optimizer.clipnorm is not None:
        c = optimizer.clipnorm
        return [_on(g, lambda g=g: (g * c) / _maximum(_norm(g), c)) for g in grads]
    scale = _global_scale(grads, optimizer.global_clipnorm)
    return [_on(g, lambda g=g: g * scale.astype(g.dtype)) for g in grads]


def clip_tensors(optimizer, tensors: list) -> list:
    """``tensors[j][i]`` (gradient j of local replica i) clipped replica by replica;
    a gradient several replicas share is clipped once and stays shared."""
    columns = [[row[i] for row in tensors] for i in range(len(tensors[0]))]
    done: dict = {}
    out = []
    for column in columns:
        key = tuple(map(id, column))
        if key not in done:
            done[key] = clip_list(optimizer, column)
        out.append(done[key])
    return [list(row) for row in zip(*out)]


def clip_flat(optimizer, buckets: list, offsets: list) -> list:
    """``[(tensor indices, [flat gradients per replica])]`` (a flat step's buckets;
    ``offsets[j]``: where variable j starts in the flat arena) clipped replica by
    replica, into new flat arrays; a flat gradient several replicas share is clipped
    once and stays shared."""
    if optimizer.clipvalue is not None:
        c = optimizer.clipvalue
        return [(idx, _shared_map(grads, lambda g: _on(g, lambda: array_module(g).clip(
            g, -c, c)))) for idx, grads in buckets]
    if optimizer.clipnorm is not None:
        c = optimizer.clipnorm

        def per_variable(flat, idx):
            def run():
                out = flat * c
                base = offsets[idx[0]]
                for j in idx:
                    lo, hi = offsets[j] - base, offsets[j + 1] - base
                    out[lo:hi] /= _maximum(_norm(flat[lo:hi]), c)
                return out
            return _on(flat, run)
        return [(idx, _shared_map(grads, lambda g, idx=idx: per_variable(g, idx)))
                for idx, grads in buckets]
    c = optimizer.global_clipnorm
    n_local = len(buckets[0][1])
    scales = []
    for i in range(n_local):
        pieces = []
        for idx, grads in buckets:
            base = offsets[idx[0]]
            pieces += [grads[i][offsets[j] - base:offsets[j + 1] - base] for j in idx]
        scales.append(_global_scale(pieces, c))
    out = []
    for idx, grads in buckets:
        made: dict = {}
        row = []
        for i, g in enumerate(grads):
            if id(g) not in made:
                made[id(g)] = _on(g, lambda g=g, s=scales[i]: g * s.astype(g.dtype))
            row.append(made[id(g)])
        out.append((idx, row))
    return out


def _shared_map(grads: list, fn) -> list:
    made: dict = {}
    out = []
    for g in grads:
        if id(g) not in made:
            made[id(g)] = fn(g)
        out.append(made[id(g)])
    return out


def _on(x, fn):
    """``fn()`` with ``x``'s device current (a host array: as it is)."""
    if type(x) is np.ndarray:
        return fn()
    with on_device_of(x):
        return fn()


def _sum_squares(g):
    xp = array_module(g)
    return xp.sum(xp.square(g))


def _norm(g):
    """The L2 norm of ``g``, 0 for an all-zero ``g`` (Keras's two-sided where)."""
    xp = array_module(g)
    l2sum = _sum_squares(g)
    positive = l2sum > 0
    return xp.where(positive, xp.sqrt(xp.where(positive, l2sum, xp.ones_like(l2sum))),
                    l2sum)


def _maximum(norm, c: float):
    return array_module(norm).maximum(norm, c)


def _global_scale(grads: list, c: float):
    """``c * min(1 / n, 1 / c) + (n - n)`` for the global norm ``n`` of ``grads``, a
    0-d array on the first gradient's device (Keras's ``clip_by_global_norm``)."""
    first = grads[0]

    def run():
        xp = array_module(first)
        squares = [_sum_squares(g) for g in grads]
        dtype = np.result_type(*[s.dtype for s in squares])
        total = xp.sum(xp.stack([xp.asarray(s, dtype=dtype) for s in squares]))
        n = xp.sqrt(total)
        with np.errstate(divide="ignore", invalid="ignore"):
            return xp.asarray(c * xp.minimum(1.0 / n, 1.0 / c) + (n - n), dtype=dtype)
    return _on(first, run)
