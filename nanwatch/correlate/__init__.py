"""Stage 4: correlation. Events become incidents with one root cause and an origin.

Kind-specific origin functions (``nan``) are imported by ``origin.origin_for`` on first use."""

from .incidents import Change, Correlator, fingerprint

__all__ = ["Change", "Correlator", "fingerprint"]
