"""Stage 4: correlation. Events become incidents with one root cause and an origin."""

from . import nan as _nan  # noqa: F401  (registers the NaN origin function)
from .incidents import Change, Correlator, fingerprint

__all__ = ["Change", "Correlator", "fingerprint"]
