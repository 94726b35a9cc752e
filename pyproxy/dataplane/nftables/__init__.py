"""The nftables dataplane: one table of pyproxy's own, verdict maps, one `nft -f` transaction per sync."""
