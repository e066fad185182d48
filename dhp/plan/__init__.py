"""Planning: the device table, and (``dhp plan``) memory, time and communication of every layout."""
