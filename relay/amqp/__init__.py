"""Everything that speaks to RabbitMQ (aio-pika, aiormq): the publisher and the frames it writes."""
