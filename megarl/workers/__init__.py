"""Ray workers and the Megatron engine they wrap (actor, reference, critic roles)."""
