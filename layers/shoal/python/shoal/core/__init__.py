"""What every context shares: settings, errors, the clock, logging, the principal, faults."""
