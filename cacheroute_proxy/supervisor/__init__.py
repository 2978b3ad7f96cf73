"""The launcher behind `cacheroute-proxy run`, after gunicorn's arbiter: `arbiter` (the master
loop), `children` (one supervised process), `rolling` (SIGHUP: replace the workers one by one)."""
