"""Pooling models: embeddings, scores and classes from the same engine (runner="pooling")."""
