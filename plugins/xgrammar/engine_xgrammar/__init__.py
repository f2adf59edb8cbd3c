"""engine-xgrammar: a structured-output backend that compiles constraints with xgrammar."""
