"""Deployment helpers: turn an experiment config into a docker compose deployment (one service per peer).

Kept out of the core package so nothing here is imported unless ``p2pfl compose`` runs.
"""
