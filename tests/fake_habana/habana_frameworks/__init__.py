"""Stand-in for the Intel Gaudi software's top-level package (see tests/fake_habana/README.md)."""
