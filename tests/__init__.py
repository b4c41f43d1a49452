"""needle's tests: a package, so test modules in different folders may share a name."""
