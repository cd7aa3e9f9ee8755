"""Merge or dynamic, per adapter: `policy.decide`, measured, cached and explained."""
