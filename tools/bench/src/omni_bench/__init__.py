"""omni benchmarks; each module's ``main(argv)`` prints one JSON object."""
