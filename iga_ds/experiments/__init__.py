"""Experiments: grids of methods x seeds x ablations trained then evaluated, the demo, and the
reports, figures and archives made from their results."""
