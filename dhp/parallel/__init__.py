"""Parallelism for one module group: sequence parallelism (Ulysses), tensor parallelism, data sharding."""
