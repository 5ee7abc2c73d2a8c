"""The version of megamoe: CMake, the wheel and megamoe.__version__ read it from here."""

__version__ = "0.1.0"
