"""Model references to files: parsing and resolving (`refs`), downloading (`download`), the local cache (`cache`)."""
