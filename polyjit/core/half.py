"""The half types in generated code: conversions between float32 and the 2-byte storage of
float16 and bfloat16, written once for every C-family dialect.

Kernels compute half values in float32 (see core/dtypes.py): a load converts to float32
(``pj_ld_<dtype>``), an op on half values rounds its float32 result to the half type and
keeps it in float32 (``pj_rnd_<dtype>``), a store converts to the 2-byte bits
(``pj_st_<dtype>``), all with round to nearest even; overflow gives inf, NaN stays NaN
(quiet). A dialect spells the bit casts and integer types (:class:`HalfSpelling`) and may
put a native conversion in front of the portable one (:attr:`HalfSpelling.native`):

- the portable float16 conversions are F. Giesen's (``half_to_float``,
  ``float_to_half_fast3_rtne``, public domain): integer rebiasing, and one float32 add or
  subtract with a power of two for subnormals (that add rounds to nearest even; it only
  ever produces normal float32 values, so flush-to-zero modes cannot change it);
- bfloat16 is the upper half of a float32: loading shifts, storing rounds the lower half
  away to nearest even;
- :data:`F64_TO_F32_ODD` turns a double into a float rounded to odd, so that a cast from
  float64 rounds correctly (once) to either half type.
"""

from __future__ import annotations

import attrs

from polyjit.core import dtypes
from polyjit.core.dtypes import DType

__all__ = ["F64_TO_F32_ODD", "HalfSpelling", "helpers", "load_name", "round_name", "store_name"]


@attrs.frozen
class HalfSpelling:
    """How a dialect writes the portable conversions. ``f2u`` / ``u2f`` are formats of one
    argument (``{}``) that reinterpret a float as its 32 bits and back; ``native`` maps a
    helper name to a guard and the lines of a native body: compiled where the guard (an
    ``#if`` condition) holds, the portable body otherwise; an empty guard replaces the
    portable body."""

    qualifier: str  # of every helper function ("static inline")
    u32: str  # a 32-bit unsigned integer type
    u16: str  # the storage type of both half types (its bits)
    f2u: str
    u2f: str
    prelude: tuple[tuple[str, list[str]], ...] = ()  # helpers the bit casts need (C: memcpy ones)
    native: tuple[tuple[str, tuple[str, list[str]]], ...] = ()  # name -> (guard, lines of the native body)


def load_name(dt: DType) -> str:
    return f"pj_ld_{dt.name}"


def store_name(dt: DType) -> str:
    return f"pj_st_{dt.name}"


def round_name(dt: DType) -> str:
    return f"pj_rnd_{dt.name}"


F64_TO_F32_ODD = "pj_f32_odd"


def _function(s: HalfSpelling, name: str, signature: str, body: list[str]) -> tuple[str, list[str]]:
    """A helper: its portable body, or the dialect's native one under its guard."""
    native = dict(s.native).get(name)
    head = f"{s.qualifier} {signature} {{"
    if native is None:
        return name, [head, *body, "}"]
    guard, lines = native
    if not guard:
        return name, [head, *lines, "}"]
    return name, [head, f"#if {guard}", *lines, "#else", *body, "#endif", "}"]


def helpers(s: HalfSpelling, batch_dtypes: set[DType]) -> list[tuple[str, list[str]]]:
    """The conversion helpers of the half types in ``batch_dtypes`` (and the float64 ->
    float32 rounding to odd when float64 is there too), each after the helpers it calls.
    ``codegen.generate`` keeps those the kernels name."""
    f2u, u2f, u32, u16 = s.f2u.format, s.u2f.format, s.u32, s.u16
    out: list[tuple[str, list[str]]] = list(s.prelude)
    if dtypes.float16 in batch_dtypes:
        out += [
            _function(s, "pj_f16_to_f32", f"float pj_f16_to_f32({u16} h)", [
                f"  {u32} o = (({u32})h & 0x7fffu) << 13;  /* exponent and mantissa */",
                f"  const {u32} e = o & 0x0f800000u;",
                "  o += 0x38000000u;  /* rebias: (127 - 15) << 23 */",
                "  if (e == 0x0f800000u) {",
                "    o += 0x38000000u;  /* inf, NaN: the float32 exponent is all ones too */",
                "  } else if (e == 0u) {  /* zero, subnormal: renormalize with a subtraction */",
                "    o += 0x00800000u;",
                f"    o = {f2u(u2f('o') + ' - 6.103515625e-05f')};",
                "  }",
                f"  return {u2f(f'o | ((({u32})h & 0x8000u) << 16)')};",
            ]),
            _function(s, "pj_f32_to_f16", f"{u16} pj_f32_to_f16(float f)", [
                f"  {u32} u = {f2u('f')};",
                f"  const {u32} sign = u & 0x80000000u;",
                f"  {u32} o;",
                "  u ^= sign;",
                "  if (u >= 0x47800000u) {  /* at least 2^16: inf; NaN stays NaN */",
                "    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;",
                "  } else if (u < 0x38800000u) {  /* below 2^-14: subnormal or zero */",
                f"    o = {f2u(u2f('u') + ' + 0.5f')} - 0x3f000000u;  /* the add rounds to even */",
                "  } else {  /* rebias, round to nearest even (a carry may reach inf) */",
                "    o = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;",
                "  }",
                f"  return ({u16})(o | (sign >> 16));",
            ]),
            _function(s, load_name(dtypes.float16), f"float {load_name(dtypes.float16)}({u16} h)",
                      ["  return pj_f16_to_f32(h);"]),
            _function(s, store_name(dtypes.float16), f"{u16} {store_name(dtypes.float16)}(float f)",
                      ["  return pj_f32_to_f16(f);"]),
            _function(s, round_name(dtypes.float16), f"float {round_name(dtypes.float16)}(float f)",
                      ["  return pj_f16_to_f32(pj_f32_to_f16(f));"]),
        ]
    if dtypes.bfloat16 in batch_dtypes:
        out += [
            _function(s, load_name(dtypes.bfloat16), f"float {load_name(dtypes.bfloat16)}({u16} h)",
                      [f"  return {u2f(f'({u32})h << 16')};"]),
            _function(s, store_name(dtypes.bfloat16), f"{u16} {store_name(dtypes.bfloat16)}(float f)", [
                f"  const {u32} u = {f2u('f')};",
                f"  if ((u & 0x7fffffffu) > 0x7f800000u) return ({u16})((u >> 16) | 0x40u);  /* NaN: quiet */",
                f"  return ({u16})((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  /* to nearest even */",
            ]),
            _function(s, round_name(dtypes.bfloat16), f"float {round_name(dtypes.bfloat16)}(float f)",
                      [f"  return {load_name(dtypes.bfloat16)}({store_name(dtypes.bfloat16)}(f));"]),
        ]
    if dtypes.float64 in batch_dtypes and batch_dtypes & set(dtypes.HALF):
        out.append(_function(s, F64_TO_F32_ODD, f"float {F64_TO_F32_ODD}(double d)", [
            "  float f = (float)d;",
            "  if ((double)f != d && d == d) {  /* inexact: toward zero, then set the last bit */",
            f"    {u32} u = {f2u('f')};",
            "    if (fabs((double)f) > fabs(d)) u -= 1u;",
            f"    f = {u2f('u | 1u')};",
            "  }",
            "  return f;",
        ]))
    return out
