"""The chaos suite: randomized faults over short distributed runs, with counts (issue 11, item 6)."""
