"""Measurement: hardware datasheets and projections on one roofline cost model
(`hardware.step_cost`), this machine's calibration and roofline, CPU load, the bench."""
