"""What a group tells about itself: stall warnings and the control channel, statistics and traces, stragglers."""
