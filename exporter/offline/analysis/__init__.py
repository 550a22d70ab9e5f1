"""Analyses of a recording (one node's or a merged fleet's): stragglers, the
verdict (`explain`) and clock skew estimated from the data."""
