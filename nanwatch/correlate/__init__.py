"""Stage 4: correlation. Events become incidents with one root cause and an origin."""

from .incidents import Change, Correlator, fingerprint

__all__ = ["Change", "Correlator", "fingerprint"]
