"""One process's view of a distributed job: World, devices, Precision, Strategy, launch, Runtime."""
