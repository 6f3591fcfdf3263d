"""lorafleet runtime: everything device-independent."""
