"""Planted sampling bugs: small named variations of `SpecSampling` that the distribution oracle must catch.

The sampling counterpart of `reference.mutants` (the greedy catalog). `CATALOG` maps name to class, and every
entry can be run with `--decoder specaudit.reference.sampling_mutants:NAME` (the class name or its lowercase
`name`). Each class documents the bug class, where it was seen ("public trackers" or "—") and the one hook of
`SpecSampling` it overrides, and carries a `bug: SamplingBug` (description, seen_in, role, check, needs_batch).
The classes live in `specaudit.reference.planted.sampling`.

`bonus_mixture(e)` is the dial: the bonus drawn from (1 - e) p + e q, a class per e (its name carries e);
`CATALOG["bonus_mixture"]` is e = 0.5. A name the greedy catalog already uses is prefixed `sampled_`.
"""

from __future__ import annotations

import functools

from specaudit.reference.planted import planted
from specaudit.reference.planted.sampling import BonusMixture, SamplingBug
from specaudit.reference.sampling import SpecSampling


@functools.cache
def bonus_mixture(e: float) -> type[SpecSampling]:
    """The dial at `e` in [0, 1]: a `BonusMixture` subclass named `bonus_mixture_{e}` (one class per e)."""
    if not 0 <= e <= 1:
        raise ValueError(f"the mixture weight e must be in [0, 1], got {e}")
    if e == BonusMixture.e:
        return BonusMixture
    label = f"{e:g}"
    cls = type(f"BonusMixture_{label.replace('.', '_').replace('-', '_')}", (BonusMixture,), {
        "e": float(e),
        "name": f"bonus_mixture_{label}",
        "__doc__": f"{BonusMixture.__doc__}\n    This class: e = {label}.",
        "__module__": __name__,
    })  # fmt: skip
    return cls


CATALOG: dict[str, type[SpecSampling]] = {
    name: cls for name, cls in planted(SamplingBug).items() if cls is not BonusMixture
}  # every planted class with a `bug: SamplingBug`; the dial is catalogued at e = 0.5 under its own name
CATALOG["bonus_mixture"] = bonus_mixture(0.5)
# the lowercase names too (`specaudit.reference.sampling_mutants:resample_from_p`); `bonus_mixture` stays the dial
globals().update({name: cls for name, cls in CATALOG.items() if name != "bonus_mixture"})
globals().update({cls.__name__: cls for cls in CATALOG.values()})  # and the class names
