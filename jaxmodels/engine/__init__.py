"""Serving engine: cache pools, padded buckets compiled once, a continuous-batching scheduler, in-graph sampling."""
