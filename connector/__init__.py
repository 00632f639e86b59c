"""pyspark_persist: see README.md (the package root re-exports DefaultSource once it exists)."""
