"""Prompt sets and loaders for margingate."""
