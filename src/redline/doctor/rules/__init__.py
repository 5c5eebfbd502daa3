"""Doctor rules, one module per area. Each rule is a pure function of the snapshot (via ``Audit``)."""
