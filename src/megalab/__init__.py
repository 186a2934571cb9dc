"""megalab: long-sequence models of the Mega family, exact and tested."""

__version__ = "0.1.0"
