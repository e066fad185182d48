"""Model families. Each family is one folder: config, modules, weight adapter, parallel plans."""
