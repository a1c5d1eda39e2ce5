"""Rollout worker supervision (``pool``): start, scale, replace dead or hung workers and read
their fingerprints. Imports no other room of the driver."""
