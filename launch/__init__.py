"""Starting a cluster: local processes, or actors on a Ray cluster."""
