"""The stall watch: where each rank is, the calls every rank must make, and their entry checks."""
