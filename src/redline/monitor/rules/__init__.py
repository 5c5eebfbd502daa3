"""Diagnosis rules, one module per area as the doctor's. Each rule is a pure function of a ``Window``."""
