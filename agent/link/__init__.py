"""The MQTT link to the fleet broker."""
