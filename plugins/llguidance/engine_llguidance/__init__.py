"""engine-llguidance: a structured-output backend built on llguidance."""
