"""Token choice on the device."""
