"""What a fit does when things go wrong: signals, non-finite losses, stalls."""
