"""Measurement: hardware datasheets and projections, the roofline cost model, calibration, the bench."""
