"""The Strata SDK: what applications import to produce and consume."""
