"""Every run is measured: step-phase timers, throughput, memory, sinks."""
