"""Index expressions of the IR: loop symbols, static symbols (kernel arguments bound at
run time) and affine sums of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import attrs
import numpy as np

from polyjit.core.dtypes import is_int
from polyjit.core.errors import InvalidArgumentError, InvalidProgramError, ValueRangeError


@attrs.frozen
class Symbol:
    """A loop symbol of an Accum's product space."""

    name: str

    def __repr__(self) -> str:
        return self.name


def _static_bound(bound: object) -> int:
    """A static's bound: an integer in [0, 2**63] (its values are int64 kernel arguments)."""
    if not is_int(bound):
        raise InvalidArgumentError(f"a StaticSymbol's bound is an integer, not {type(bound).__name__} {bound!r}")
    if not 0 <= bound <= 2**63:
        raise ValueRangeError(f"a StaticSymbol's bound {bound} is outside [0, 2**63] (its values are int64)")
    return int(bound)


@attrs.frozen
class StaticSymbol:
    """An index whose value is a kernel argument bound when ``run()`` enqueues (e.g. a batch index).

    ``bound`` is the exclusive upper limit of its values, checked at run time.
    """

    name: str
    bound: int = attrs.field(converter=_static_bound)

    def __repr__(self) -> str:
        return f"${self.name}"


Var = Union[Symbol, StaticSymbol]


@attrs.frozen
class Affine:
    """``sum(coeff * var) + const`` over loop and static symbols. Terms are kept sorted and non-zero."""

    terms: tuple[tuple[Var, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(mapping: Mapping[Var, int], const: int = 0) -> Affine:
        items = [(v, int(c)) for v, c in mapping.items() if c != 0]
        items.sort(key=lambda vc: (isinstance(vc[0], StaticSymbol), vc[0].name))
        return Affine(tuple(items), int(const))

    def coeff(self, var: Var) -> int:
        for v, c in self.terms:
            if v == var:
                return c
        return 0

    @property
    def vars(self) -> tuple[Var, ...]:
        return tuple(v for v, _ in self.terms)

    def as_dict(self) -> dict[Var, int]:
        return dict(self.terms)

    def __add__(self, other: Affine) -> Affine:
        d = self.as_dict()
        for v, c in other.terms:
            d[v] = d.get(v, 0) + c
        return Affine.of(d, self.const + other.const)

    def scale(self, k: int) -> Affine:
        return Affine.of({v: c * k for v, c in self.terms}, self.const * k)

    def substitute(self, env: Mapping[Var, Affine]) -> Affine:
        out = Affine((), self.const)
        for v, c in self.terms:
            out = out + (env[v].scale(c) if v in env else Affine(((v, c),)))
        return out

    def __repr__(self) -> str:
        parts = [(f"{c}*{v!r}" if c != 1 else repr(v)) for v, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


def fixed(k: int) -> Affine:
    """A fixed index."""
    return Affine((), int(k))


def affine(*terms: tuple[int, Var], const: int = 0) -> Affine:
    """``affine((2, i), (1, j), const=3)`` is ``2*i + j + 3``."""
    d: dict[Var, int] = {}
    for c, v in terms:
        d[v] = d.get(v, 0) + c
    return Affine.of(d, const)


Index = Union[Symbol, StaticSymbol, Affine, int]


def as_affine(index: Index) -> Affine:
    if isinstance(index, Affine):
        return index
    if isinstance(index, (Symbol, StaticSymbol)):
        return Affine(((index, 1),))
    if isinstance(index, (int, np.integer)):
        return fixed(int(index))
    raise InvalidProgramError(f"not an index expression: {index!r}")
