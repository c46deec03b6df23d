"""Console entry points: thin wrappers that parse arguments and call the library."""
