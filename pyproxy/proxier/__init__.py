"""The proxier: sources record changes, one runner syncs, the dataplane applies."""
