"""The engine pool (Ray Serve): its application, and a sweep's way into it."""
